"""Named dimensions and ValueMesh, without processes: what slicing a mesh does to its
shape, and the errors a user sees for a bad selection."""
from __future__ import annotations

import pickle

import pytest

from monarch_kernel.core.shape import Extent, MeshView, Point, parse_rank_spec
from monarch_kernel.core.values import ValueMesh


def view24() -> MeshView:
    return MeshView(("hosts", "gpus"), (2, 4))


# ---------------------------------------------------------------- Extent and Point
def test_extent_is_an_ordered_mapping_of_sizes():
    e = Extent(("hosts", "gpus"), (2, 4))
    assert list(e) == ["hosts", "gpus"]
    assert dict(e) == {"hosts": 2, "gpus": 4}
    assert e["gpus"] == 4 and e.nelements == 8 and len(e) == 2
    assert e == Extent(["hosts", "gpus"], [2, 4]) and hash(e) == hash(Extent(("hosts", "gpus"), (2, 4)))
    assert e != Extent(("gpus", "hosts"), (4, 2))
    with pytest.raises(KeyError):
        e["nodes"]
    with pytest.raises(ValueError, match="2 labels but 1 sizes"):
        Extent(("a", "b"), (1,))
    assert pickle.loads(pickle.dumps(e)) == e


def test_point_coords_are_row_major():
    e = Extent(("hosts", "gpus"), (2, 4))
    p = Point(6, e)
    assert p.coords == {"hosts": 1, "gpus": 2}
    assert p["gpus"] == 2 and int(p) == 6 and p.rank == 6
    assert [10, 11, 12, 13, 14, 15, 16][p] == 16  # usable as an index
    assert repr(p) == "Point(rank=6, hosts=1, gpus=2)"
    assert pickle.loads(pickle.dumps(p)) == p
    assert [Point(r, e).coords for r in (0, 3, 4, 7)] == [
        {"hosts": 0, "gpus": 0}, {"hosts": 0, "gpus": 3}, {"hosts": 1, "gpus": 0}, {"hosts": 1, "gpus": 3}]


# ---------------------------------------------------------------- slicing
def test_int_drops_the_dim_and_slice_keeps_it():
    v = view24()
    one_host = v.slice(hosts=1)
    assert (one_host.labels, one_host.sizes, one_host.ranks) == (("gpus",), (4,), (4, 5, 6, 7))
    kept = v.slice(hosts=slice(1, 2))
    assert (kept.labels, kept.sizes, kept.ranks) == (("hosts", "gpus"), (1, 4), (4, 5, 6, 7))
    both = v.slice(hosts=0, gpus=slice(1, 3))
    assert (both.labels, both.sizes, both.ranks) == (("gpus",), (2,), (1, 2))
    single = v.slice(hosts=1, gpus=3)
    assert (single.labels, single.sizes, single.ranks) == ((), (), (7,))
    assert single.describe() == "a single member"


def test_slices_compose_on_underlying_ranks():
    v = view24().slice(gpus=slice(1, None, 2))          # gpus 1 and 3
    assert v.ranks == (1, 3, 5, 7) and v.sizes == (2, 2)
    w = v.slice(hosts=1, gpus=-1)
    assert w.ranks == (7,)
    assert view24().slice(gpus=range(0, 4, 3)).ranks == (0, 3, 4, 7)


def test_negative_index_counts_from_the_end():
    assert view24().slice(hosts=-1).ranks == (4, 5, 6, 7)


def test_unknown_dimension_names_the_dims_there_are():
    with pytest.raises(ValueError, match=r"unknown dimension 'nodes'.*hosts, gpus"):
        view24().slice(nodes=0)
    with pytest.raises(ValueError, match="unknown dimension 'nodes'"):
        view24().size("nodes")
    with pytest.raises(ValueError, match="unknown dimension 'x'"):
        view24().rename(x="y")


def test_out_of_range_index_names_the_dim_and_its_size():
    with pytest.raises(ValueError, match=r"gpus=4 is out of range: gpus has size 4 \(valid indices 0..3\)"):
        view24().slice(gpus=4)
    with pytest.raises(ValueError, match=r"hosts=-3 is out of range"):
        view24().slice(hosts=-3)
    with pytest.raises(ValueError, match=r"gpus=5:7 starts out of range"):
        view24().slice(gpus=slice(5, 7))
    with pytest.raises(ValueError, match=r"gpus=2:2 selects no members"):
        view24().slice(gpus=slice(2, 2))


def test_selection_of_the_wrong_type_says_what_to_use():
    for bad in ("1", 1.0, True, [0, 1]):
        with pytest.raises(TypeError, match=r"select with an int or a slice"):
            view24().slice(gpus=bad)


def test_flatten_and_rename():
    v = view24().slice(gpus=slice(2, 4))
    f = v.flatten("ranks")
    assert (f.labels, f.sizes, f.ranks) == (("ranks",), (4,), (2, 3, 6, 7))
    r = v.rename(gpus="devices")
    assert (r.labels, r.sizes, r.ranks) == (("hosts", "devices"), (2, 2), v.ranks)
    assert r.size("devices") == 2 and len(r) == 4
    assert r.extent == Extent(("hosts", "devices"), (2, 2))


def test_points_enumerate_the_view_in_order():
    pts = list(view24().slice(hosts=1).points())
    assert [p.rank for p in pts] == [0, 1, 2, 3]
    assert pts[2].coords == {"gpus": 2}


def test_view_checks_its_member_count_and_pickles():
    with pytest.raises(ValueError, match="8 members expected"):
        MeshView(("hosts", "gpus"), (2, 4), range(7))
    v = view24().slice(gpus=1)
    assert pickle.loads(pickle.dumps(v)) == v


# ---------------------------------------------------------------- the rank grammar
@pytest.mark.parametrize("spec, ranks", [
    ("3", (3,)), ("1,4,6", (1, 4, 6)), ("0:8:2", (0, 2, 4, 6)), ("ranks(5:)", (5, 6, 7)),
    ("-1", (7,)), ("6,1,1", (1, 6)),
    # first-last, both included: the form the notebook prints ranks in ("[ranks 0-2,5]")
    ("0-2,5", (0, 1, 2, 5)), ("3-3", (3,)), ("ranks(6-7)", (6, 7)), (" 1 - 2 ", (1, 2)),
])
def test_plain_rank_specs_address_the_flattened_mesh(spec, ranks):
    v = parse_rank_spec(spec, view24())
    assert v.labels == ("ranks",) and v.ranks == ranks


def test_named_rank_specs_slice_by_dim():
    v = parse_rank_spec("gpus=1:3", view24())
    assert (v.labels, v.ranks) == (("hosts", "gpus"), (1, 2, 5, 6))
    v = parse_rank_spec("ranks(hosts=1,gpus=0)", view24())
    assert (v.labels, v.ranks) == ((), (4,))
    v = parse_rank_spec("hosts=1,gpus=2-3", view24())
    assert (v.labels, v.ranks) == (("gpus",), (6, 7))


@pytest.mark.parametrize("spec, msg", [
    ("", "empty rank spec"), ("8", r"rank 8 is outside the mesh: valid ranks are 0..7"),
    ("abc", "malformed rank spec"), ("gpus=1,3", "mix of named"), ("9:12", "selects nothing"),
    ("nodes=1", "unknown dimension 'nodes'"),
    ("0-8", r"ranks 0-8 end outside the mesh: valid ranks are 0..7"), ("5-2", "runs backwards; write 2-5"),
    ("gpus=2-4", r"gpus=2-4 ends out of range: gpus has size 4"), ("1-", "malformed rank spec"),
])
def test_bad_rank_specs_say_what_is_wrong(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_rank_spec(spec, view24())


# ---------------------------------------------------------------- ValueMesh
def vm() -> ValueMesh:
    return ValueMesh(Extent(("hosts", "gpus"), (2, 2)), ["a", "b", "c", "d"])


def test_value_mesh_items_values_and_iteration():
    m = vm()
    assert m.values() == ["a", "b", "c", "d"] and len(m) == 4
    items = list(m.items())
    assert [(p.coords, v) for p, v in items] == [
        ({"hosts": 0, "gpus": 0}, "a"), ({"hosts": 0, "gpus": 1}, "b"),
        ({"hosts": 1, "gpus": 0}, "c"), ({"hosts": 1, "gpus": 1}, "d")]
    assert [(p.rank, v) for p, v in m] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert m[2] == "c" and m.extent == Extent(("hosts", "gpus"), (2, 2))


def test_value_mesh_item_by_coords():
    m = vm()
    assert m.item(hosts=1, gpus=0) == "c"
    with pytest.raises(ValueError, match=r"unknown dimension\(s\) \['nodes'\]"):
        m.item(nodes=0, hosts=0, gpus=0)
    with pytest.raises(ValueError, match=r"missing \['gpus'\]"):
        m.item(hosts=0)
    with pytest.raises(ValueError, match=r"gpus=2 is out of range \(size 2\)"):
        m.item(hosts=0, gpus=2)
    assert ValueMesh(Extent((), ()), [42]).item() == 42


def test_value_mesh_pickles_and_compares():
    m = vm()
    back = pickle.loads(pickle.dumps(m))
    assert back == m and back.values() == m.values() and back.extent == m.extent
    assert m != ValueMesh(Extent(("hosts", "gpus"), (2, 2)), ["a", "b", "c", "x"])
    with pytest.raises(ValueError, match="3 values for an extent of 4"):
        ValueMesh(Extent(("hosts", "gpus"), (2, 2)), [1, 2, 3])


def test_value_mesh_reprs_show_coords_and_values():
    assert repr(vm()) == "ValueMesh(hosts=2, gpus=2) {hosts=0,gpus=0: 'a', hosts=0,gpus=1: 'b', " \
                         "hosts=1,gpus=0: 'c', hosts=1,gpus=1: 'd'}"
    html = ValueMesh(Extent(("gpus",), (1,)), ["<b>"])._repr_html_()
    assert "<th>gpus</th>" in html and "&#x27;&lt;b&gt;&#x27;" in html

"""The installed kernelspec carries the logos JupyterLab's launcher shows for the kernel."""
from __future__ import annotations

from jupyter_client.kernelspec import KernelSpecManager
from PIL import Image

from monarch_kernel.install import install


def test_kernelspec_ships_32_64_and_svg_logos(tmp_path):
    dest = install(prefix=str(tmp_path))
    spec = KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")]).get_kernel_spec("monarch")
    assert spec.resource_dir == dest
    for size in (32, 64):
        with Image.open(f"{dest}/logo-{size}x{size}.png") as img:
            assert img.size == (size, size) and img.mode == "RGBA"
    assert open(f"{dest}/logo-svg.svg").read().startswith("<svg ")

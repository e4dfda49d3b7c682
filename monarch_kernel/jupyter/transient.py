"""A widget while it works, a plain line of text after: what our widgets leave in a notebook.

A widget saved in a notebook outlives its kernel-side model: reopened, JupyterLab shows
"Error displaying widget: model not found" (or a broken-link icon after a restart). So
every widget we show (the ``%mesh connect`` progress bar, the debugger) is shown with a
display id, and ``settle(text)`` replaces that output in place by ``text`` and closes the
widget; the kernel settles what is still shown when it shuts down or restarts. A saved
notebook then holds plain text where the widget was. (JupyterLab applies such an update
whenever it arrives, also after the cell ended; the update sent while the kernel shuts down
for a restart was not seen to land, so settle before that where it matters.)
"""
from __future__ import annotations

import threading
import uuid

_SHOWN: dict[str, TransientWidget] = {}
_LOCK = threading.Lock()


class TransientWidget:
    def __init__(self, widget, text: str = ""):
        """Show ``widget`` under the running cell; ``text`` is what a front-end without
        widgets shows meanwhile (default: the widget's repr)."""
        from IPython.core.getipython import get_ipython

        self.widget = widget
        self.display_id = uuid.uuid4().hex
        self.settled = False
        self.shell = get_ipython()
        kernel = getattr(self.shell, "kernel", None)
        # the update goes out under the request of the cell that showed the widget (not
        # under a button's comm message), so a front-end relating outputs to cells sees it
        self.parent = kernel.get_parent("shell") if kernel is not None else None
        bundle = widget._repr_mimebundle_() if hasattr(widget, "_repr_mimebundle_") else {}
        if isinstance(bundle, tuple):
            bundle = bundle[0]
        data = dict(bundle or {"text/plain": repr(widget)})
        if text:
            data["text/plain"] = text
        with _LOCK:
            _SHOWN[self.display_id] = self
        self._publish(data, update=False)

    def settle(self, text: str) -> None:
        """Replace the widget's output by ``text`` and close the widget (once)."""
        with _LOCK:
            if self.settled:
                return
            self.settled = True
            _SHOWN.pop(self.display_id, None)
        self._publish({"text/plain": text}, update=True)
        try:
            self.widget.close()
        except Exception:
            pass

    def _publish(self, data: dict, update: bool) -> None:
        pub = getattr(self.shell, "display_pub", None)
        if pub is None:
            print(data.get("text/plain", ""))
            return
        publish = lambda: pub.publish(data=data, metadata={}, transient={"display_id": self.display_id},
                                      update=update)
        setp = getattr(pub, "set_thread_parent", None)
        if setp is None or self.parent is None:
            publish()
            return
        token = setp(self.parent)
        try:
            publish()
        finally:
            pub.reset_thread_parent(token)


def settle_all(text: str) -> None:
    """Kernel shutdown or restart: every widget still shown becomes ``text``."""
    with _LOCK:
        shown = list(_SHOWN.values())
    for w in shown:
        w.settle(text)

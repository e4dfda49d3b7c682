"""A shim, kept for the command line: the node side lives in ``monarch_kernel.node``.

Deployments, Kubernetes pod specs and docs start host agents as ``python -m workers.agent
...``, and user code may ``import workers.proc``; both keep working: every ``workers.X`` is
an alias of ``monarch_kernel.node.X``, the same module object (``monarch_kernel/moved.py``
says how, and why there is no file per module here). New code imports ``monarch_kernel.node``.
"""
from monarch_kernel import moved

moved.install()

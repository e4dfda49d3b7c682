"""``python -m monarch_kernel -f CONNECTION_FILE``: start the Monarch kernel."""
from ipykernel.kernelapp import IPKernelApp

from monarch_kernel.jupyter.kernel import MonarchKernel

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=MonarchKernel)

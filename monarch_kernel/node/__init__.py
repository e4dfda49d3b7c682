"""Node side of monarch-kernel: the host agent, its warm zygote, and the proc worker loop."""

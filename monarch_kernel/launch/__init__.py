"""Where hosts come from. ``local`` starts an agent on this machine."""

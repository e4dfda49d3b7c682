"""The runtime shared by controllers and workers. Imports nothing from Jupyter."""

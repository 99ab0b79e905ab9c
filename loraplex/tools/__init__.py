"""Tools built on the whole of loraplex (not imported by the engine or the platform): the demo
adapters' trainer."""

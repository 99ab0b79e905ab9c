"""One module per schema revision, ``NNNN_<slug>.py``, applied in ``down_revision`` order."""

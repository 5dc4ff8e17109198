"""ipywidgets panels for the notebooks, one module per topic.

Each panel redraws through a pure function in the same module (arguments in, Figure or data
out) that the tests call directly; the panel only wires sliders to it with
``continuous_update=False``.
"""

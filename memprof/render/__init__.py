"""Renderers: each takes a Trace (or anything holding one as ``.trace``) or a result of
:mod:`memprof.analyse` or :mod:`memprof.simulate`, and returns output; none reaches back into a profile.

* :mod:`.text` -- terminal text; :mod:`.html` -- notebook HTML; :mod:`.page` -- the standalone HTML page;
* :mod:`.frames` -- pandas DataFrames; :mod:`.plot` -- matplotlib figures; :mod:`.svg` -- the timeline as SVG;
* :mod:`.chrome`, :mod:`.memory_viz` -- the open formats; :mod:`.export` -- writing them to files;
* :mod:`.common` and :mod:`.curve` -- what they share: the spelling of a missing figure, colors, the module
  rows, the memory curve.
"""

"""Renderers: each takes a record (a Trace, a Report, a Reconciliation, a Diff) and returns output.

* :mod:`.text` -- terminal text; :mod:`.html` -- notebook HTML;
* :mod:`.frames` -- pandas DataFrames; :mod:`.plot` -- matplotlib figures;
* :mod:`.common` -- what they share: the spelling of a missing figure, colors, the module rows.
"""

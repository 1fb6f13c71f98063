"""Pure functions of Traces that return data: the reconciliation (:mod:`.reconciler`), a phase's breakdown
(:mod:`.breakdowns`), budgets (:mod:`.budget`), two runs compared (:mod:`.compare`), the ranks of one run
(:mod:`.merge`). Nothing here renders: :mod:`memprof.report` pairs these results with :mod:`memprof.render`."""

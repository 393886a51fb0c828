"""What a run shows about itself: where step time goes (:mod:`~ftrain.observability.step_phases`),
the metrics lines (:mod:`~ftrain.observability.metrics`), progress on a terminal
(:mod:`~ftrain.observability.progress`), and ``ftrain report``'s HTML page of a whole job
(:mod:`~ftrain.observability.run_report`, :mod:`~ftrain.observability.report_page`, rendered to
PNG by :mod:`~ftrain.observability.browser`).

Reads logs and events; changes nothing a run computes.
"""

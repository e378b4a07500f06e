"""Reports: plain-words disclosure (markdown/HTML) and plots. Drawing only, no computation.

* :mod:`kvcal.report.data` — what to show, pulled out of artifact metadata / evaluation JSON;
* :mod:`kvcal.report.plots` — matplotlib figures from that data (object API, Agg-safe);
* :mod:`kvcal.report.disclosure` — ``report.md`` + self-contained ``report.html``
  (:func:`~kvcal.report.disclosure.write_report`, used by ``kvcal report``);
* :mod:`kvcal.report.markdown` — the calibration-time ``report.md`` written into every artifact.
"""

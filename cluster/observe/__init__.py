"""What watches a run and reports on it: the watcher (logs, first failure, stop all), the hang
watchdog and its learned timeout, the slow-node rule, the workers' own errors, the timeline
and its picture, `cluster top`; goodput, the live metrics (Prometheus's text format) and the
alerts (POSTed): views of the one record the timeline keeps."""

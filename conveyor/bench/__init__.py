"""`conveyor bench`: a serving benchmark (workloads, arrivals, backends, metrics, pictures) and the
static / dynamic / continuous batching comparison. Entry point: `conveyor.bench.cli.main`."""

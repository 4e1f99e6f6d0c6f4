"""The run directory: its lock, checkpoints and resuming, the log and progress line,
trackers, evaluation results and the report, stop signals and export."""

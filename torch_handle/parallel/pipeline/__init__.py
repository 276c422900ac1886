"""Pipeline parallelism: schedules, point-to-point links and the executor, written by hand; and the timeline."""

"""Model parallelism: tensor parallelism (by hand and with DTensor), pipeline schedules, expert parallelism, context
parallelism's attentions (``context``), and the device mesh they share with data parallelism."""

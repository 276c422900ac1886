"""Model parallelism: tensor parallelism (by hand and with DTensor), and the device mesh it shares with data parallelism."""

"""The ``handle`` command line and dashboard. Nothing else imports this package."""

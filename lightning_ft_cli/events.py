"""The event log's reader, where ``docs/observability.md`` showed it before the log moved to :mod:`lightning_ft_job`."""

from lightning_ft_job.events import read_events

__all__ = ["read_events"]

"""The scheduler core (pure Python, no torch): queues, KV block pool, continuous batching.

Only the core is exported here; the process loop lives in `services.scheduler.server` and is
imported on its own, so importing this package stays light.
"""

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.scheduler.stats import StepRecord

__all__ = ["Scheduler", "SchedulerConfig", "StepRecord"]

"""Kept for old imports: the Mooncake backend is ``tierkv.tiers.remote.mooncake``."""

from .remote.client import parse_host_port, tcp_reachable  # noqa: F401
from .remote.mooncake import *  # noqa: F403
from .remote.mooncake import MIN_SEGMENT, MooncakeClient, MooncakeSettings, import_mooncake  # noqa: F401

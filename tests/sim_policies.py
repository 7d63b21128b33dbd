"""A custom eviction policy for the simulator tests, loadable as ``sim_policies:MRUPolicy``."""

from tierkv.policies import LRUPolicy
from tierkv.policies.eviction import _take


class MRUPolicy(LRUPolicy):
    """Most recently used first: the opposite of LRU, so a wrong hook order shows at once."""

    name = "mru"
    follows_level_order = False  # (it reads its own ``_od``)

    def victims(self, nbytes, protected):
        return _take(((k, self._od[k]) for k in reversed(self._od)), nbytes, protected)

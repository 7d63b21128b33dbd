"""The location code: the ``int`` a located tier gives each chunk and the level's index keeps for it.

A contract between the level's index (``tierkv.engine.levelindex``, the code's keeper and the
only reader of the rest of its packed encoding) and the located media (the slab under ``hbm``
and ``dram``, ``tierkv.tiers.slab``), which build codes: ``X << CODE_SHIFT | f << 1 | 1``, where
``X`` is the tier's own, ``f`` the chunk's nbytes when below ``NB_FIELD`` and ``NB_FIELD``
otherwise (then ``Tier.code_nbytes`` tells the size).  Both sides import it from here, so the
media need nothing of the store engine.
"""

#: a location code's shift: ``X << CODE_SHIFT | f << 1 | 1``
CODE_SHIFT = 25
#: the largest nbytes a code's ``f`` field holds; all ones: the size is elsewhere (``Tier.code_nbytes``)
NB_FIELD = (1 << 24) - 1

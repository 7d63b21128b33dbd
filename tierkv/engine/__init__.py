"""The store engine: what ``tierkv.TieredStore`` (``tierkv/store.py``, a thin facade) is made of.

Each part is an object of its own module, built from a ``Chain`` and the parts it calls:

* ``level``: ``Level``, one tier as the store sees it (index, reservations, pins, eviction), sealed;
  its index is ``levelindex`` (``LevelIndex``: the state and its mutators), whose questions are
  ``indexqueries`` (``IndexQueries``), policy order view ``orderview`` (``OrderView``) and invariant
  checker ``indexcheck`` (``check_index``); its victim search is ``victims`` (``choose_victims``);
* ``chain``: ``Chain``, the levels fastest first, the one lock and the call gate;
* ``durable``: ``Durability``, the chunks acknowledged but not durable, and why;
* ``tierio``: ``TierIO``, the one choke point for tier I/O (a medium fault is a miss);
* ``placer``: ``Placer``, placement, eviction, demotion, write-through;
* ``writer``: ``Writer``, the put path in named phases;
* ``reader``: ``Reader``, the get path in named phases, ``lookup`` and ``locate``;
* ``copier``: ``Copier``, write-behind and promotion on one background queue (``background``);
* ``recovery``: indexing what persistent media kept; ``observers``: batch observers;
* ``report``: the figures ``stats()`` answers.

Foundations (``tierkv.buffers``, ``tierkv.hostmem``, ``tierkv.hooks``...) sit below; nothing here
imports the adapters or the operator tools.
"""

"""Owner control: the owner steers its nodes with signed commands, and standby nodes follow demand.

- :mod:`.commands`: what a command and its result are, sealed as envelopes (``identity/envelope.py``):
  a command is signed by the owner key and encrypted to the target node; a result is signed by that
  node (and encrypted back to the owner when the command opened).
- :mod:`.policy`: whether a node executes a command (sans-IO): a fresh, unreplayed envelope from the
  owner whose certificate the node carries and whose key its trust store trusts.
- :mod:`.relay`: envelopes travel hop by hop over ``owner`` streams to nodes the sender is not
  connected to (a sans-IO route finder and its asyncio driver).
- :mod:`.executor`: what each command does on the node (load, unload, drain, config, status).
- :mod:`.standby`: the standby controller (sans-IO) that starts serving a wanted model when the mesh
  cannot keep up, and stops when it has been idle; and its driver.
- :mod:`.service`: the node's owner-control parts wired together; :mod:`.routes`: its HTTP routes.

The demand map itself is mesh state and lives in ``mesh/demand.py``.
"""

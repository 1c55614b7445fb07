"""kvspec's specification: one module per layer, each readable on its own.

Read in this order:

* ``spec.errors`` -- the typed errors and the "failed operations change nothing" rule.
* ``spec.invariants`` -- how invariants are named and registered.
* ``spec.block_pool`` -- layer 1: physical blocks, reference counts, free queue, hash map.
* ``spec.block_manager`` -- layer 2: block tables, fork, copy-on-write, swap moves.
* ``spec.implementation`` -- what an implementation under test provides.
"""

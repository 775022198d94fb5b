"""Speculative decoding: draft proposers and DSpark's verify planner (`planner.py`, plain Python).

The confidence head that feeds the planner lives with the model (`deepserve.model.confidence`), since it reads
the MTP block's hidden states.
"""

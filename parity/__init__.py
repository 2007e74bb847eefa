"""jaxamp's parity suite: the same models under torch's GradScaler and under jaxamp.

The only package besides the tests that imports torch. Run ``python -m parity``
(``--list`` for the scenarios); see docs/parity.md.
"""

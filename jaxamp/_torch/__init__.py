"""torch's semantics, readable beside torch's source: the scale rule, exact
unscaling, the inf/NaN check, clipping, accumulation, schedules, several
optimizers, and the ``state_dict`` format. Plain JAX: no compiler workaround."""

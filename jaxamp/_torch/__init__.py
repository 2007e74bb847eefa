"""torch's semantics, readable beside torch's source: the scale rule, exact
unscaling, the inf/NaN check, clipping, schedules and several optimizers. Plain
JAX: no compiler workaround, and nothing imported from the modules above it."""

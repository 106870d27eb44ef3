"""The model as fz runs it: a meta skeleton cut into units, and initial values."""

"""Outer steps (DiLoCo, a method on the pseudo-gradients) against per-step exchange across slow links."""

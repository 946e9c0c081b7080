"""Offline distillation: capture the teacher once into a store, then train from it."""

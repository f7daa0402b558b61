"""Keras' PyTorch backend (`KERAS_BACKEND=torch`): probe, micro-batched step, replay.

Imports torch and Keras, never TensorFlow or JAX.
"""

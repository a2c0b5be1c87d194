"""A readable, scalable GPT in JAX: model, data, training, sampling."""

"""Uses of private TensorFlow and Keras APIs, one module per topic (see each module)."""

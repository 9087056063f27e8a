"""Private TensorFlow and Keras API use, one module per topic, each use commented with what, why and the versions checked."""

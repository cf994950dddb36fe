"""Dense image classification: Fashion-MNIST with a CNN and scikit-learn's digits with an MLP."""

"""Training of TokenSwift draft layers on a frozen base model."""

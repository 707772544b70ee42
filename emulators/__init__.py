"""emulators."""

"""sandboxd."""

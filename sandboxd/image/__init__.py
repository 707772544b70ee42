"""The sandbox image of the Docker backend: its Dockerfile and the in-container agent."""

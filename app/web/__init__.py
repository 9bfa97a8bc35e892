"""Server-rendered web page of the service."""

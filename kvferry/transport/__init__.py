"""Transport: the only code that owns copy streams, events and staging buffers."""

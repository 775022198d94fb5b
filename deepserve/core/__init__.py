"""The torch-free heart of deepserve: configuration, request and output value objects, plugin machinery."""

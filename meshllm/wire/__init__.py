"""Frame codec and the message structs shared by several layers."""

"""qasr.server"""

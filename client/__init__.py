"""qasr.client"""

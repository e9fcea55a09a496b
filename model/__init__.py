"""qasr.model"""

"""qasr.streaming"""

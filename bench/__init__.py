"""qasr.bench"""

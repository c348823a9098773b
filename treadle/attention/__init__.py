"""attention"""

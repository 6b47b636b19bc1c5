"""actors/executor"""
